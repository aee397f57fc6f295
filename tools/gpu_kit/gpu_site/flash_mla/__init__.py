"""Import-only stub for ``flash_mla`` (GPU server check): the device has no FlashMLA wheel.

SGLang 0.5.23's EAGLE worker imports the FlashMLA attention backend on CUDA (to list the
backends whose draft-extend step graphs capture), which imports ``flash_mla`` unguarded. The
check runs the Triton backend and never calls FlashMLA; any call here raises.
"""

from collections.abc import Callable


def _unavailable(name: str) -> Callable[..., None]:
    def call(*args, **kwargs) -> None:
        raise NotImplementedError(f"flash_mla import stub: {name} is not available in the GPU server check")

    call.__name__ = name
    return call


def __getattr__(name: str) -> Callable[..., None]:
    if name.startswith("__"):
        raise AttributeError(name)
    return _unavailable(name)
