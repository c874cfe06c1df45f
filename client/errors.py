"""Exceptions raised by the client."""


class LoaderError(RuntimeError):
    """The service reported an error. ``code`` is a protocol ErrorCode; ``remote_traceback``
    is the worker's traceback when the error happened in a worker process."""

    def __init__(self, code: str, message: str, remote_traceback: str = ""):
        text = f"[{code}] {message}"
        if remote_traceback:
            text += "\n--- traceback from the service worker ---\n" + remote_traceback.rstrip()
        super().__init__(text)
        self.code, self.message, self.remote_traceback = code, message, remote_traceback


class LoaderTimeout(LoaderError, TimeoutError):
    """Nothing arrived from the service within the loader's ``timeout``."""

    def __init__(self, message: str):
        super().__init__("timeout", message)
