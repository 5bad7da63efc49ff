"""User-facing errors: one line that names the problem and the fix."""


class SelfspecError(ValueError):
    """A problem with the user's input or environment. The CLI prints it as one line, exit 2."""


def missing_dependency(package: str, extra: str, purpose: str) -> SelfspecError:
    """The error for an optional dependency that is not installed."""
    return SelfspecError(
        f"{purpose} needs the optional package '{package}', which is not installed: "
        f"pip install 'selfspec[{extra}]' (or pip install {package})"
    )
