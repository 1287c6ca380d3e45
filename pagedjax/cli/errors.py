"""How a run of `pagedjax-generate` ends: its exit statuses, and CLIError for problems found while running."""

EXIT_OK, EXIT_REQUEST_FAILED, EXIT_ERROR, EXIT_INTERRUPTED = 0, 1, 2, 130


class CLIError(Exception):
    """A problem found while running (not in the arguments' syntax): shown as one line, exit status 2."""
