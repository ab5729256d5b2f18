"""The error a bad spec raises: where it is (file, key path) and why, never a bare assert."""


class SpecError(ValueError):
    def __init__(self, file, key_path: str, reason: str):
        self.file, self.key_path, self.reason = str(file), key_path, reason
        where = f"{self.file}: {key_path}" if key_path else self.file
        super().__init__(f"{where}: {reason}")
