"""What a Tinker request can be refused with."""


class UserFault(ValueError):
    """The request is wrong: HTTP 400 at once, or its future fails with category "user"."""


class NotFound(KeyError):
    """An id the service does not know: HTTP 404."""

    def __str__(self) -> str:
        return str(self.args[0])
