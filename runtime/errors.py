"""Errors that fp4gen raises besides the standard ValueError/TypeError for bad arguments."""


class BuildError(RuntimeError):
    """A kernel that the call needs is not generated, not built, or built from stale sources.

    The message names the kernel (or the operation, arch and dtypes that no kernel matches) and the
    command that fixes it.
    """


class KernelError(RuntimeError):
    """A built kernel refused a problem or failed to launch; the message carries its status."""
