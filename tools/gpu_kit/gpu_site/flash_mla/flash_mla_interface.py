"""Import-only stub of ``flash_mla.flash_mla_interface`` (see the package docstring)."""


class FlashMLASchedMeta:
    """A class, as SGLang names it in type unions; building one raises."""

    def __init__(self, *args, **kwargs) -> None:
        raise NotImplementedError("flash_mla import stub: FlashMLASchedMeta is not available")
