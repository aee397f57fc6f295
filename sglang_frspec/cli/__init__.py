"""The ``sglang-frspec`` command line."""


def main(argv=None) -> int:
    return 0
