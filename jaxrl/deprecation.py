"""Names of the Python API that changed keep working for a release: a call with an old keyword
argument is passed on under its new name, with a DeprecationWarning that names the new one."""

from __future__ import annotations

import functools
import warnings


def renamed_arguments(**new_names: str):
    """Decorates a function whose keyword arguments `new_names` (old=new) were renamed."""

    def wrap(fn):
        @functools.wraps(fn)
        def call(*args, **kwargs):
            for old, new in new_names.items():
                if old not in kwargs:
                    continue
                if new in kwargs:
                    raise TypeError(f"{fn.__qualname__}() got both {old}= and {new}=; "
                                    f"{old} is the old name of {new}")
                warnings.warn(f"{fn.__qualname__}({old}=...) is deprecated: pass {new}=...",
                              DeprecationWarning, stacklevel=2)
                kwargs[new] = kwargs.pop(old)
            return fn(*args, **kwargs)

        return call

    return wrap
