"""What launch() raises when a job fails as a whole."""


class LaunchError(RuntimeError):
    """The job failed as a whole: a rank crashed, ran out of memory, or could not start.

    `failures` maps rank -> one-line reason; `outputs` maps rank -> what the rank printed.
    """

    def __init__(self, message, failures=None, outputs=None):
        super().__init__(message)
        self.failures = failures or {}
        self.outputs = outputs or {}


class LaunchTimeout(LaunchError, TimeoutError):
    """The job did not finish within `timeout` seconds (a deadlock, or a loop that never ends)."""


class RemoteTraceback(Exception):
    """Carries a worker's formatted traceback as the `__cause__` of a re-raised exception."""

    def __str__(self):
        return self.args[0]
