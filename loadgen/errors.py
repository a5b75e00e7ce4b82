class UsageError(Exception):
    """A problem with the user's input (flags, files, server address): shown as one line, exit code 2."""
