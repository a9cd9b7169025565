"""The lent GPU machine's missing packages, made missing here: `gpu_check.sh --rehearse` puts this folder first
on PYTHONPATH, so this runs at the start of every Python process of the rehearsal and of every process those
start (children inherit PYTHONPATH).

LENT_MACHINE_LACKS names them (comma-separated import or distribution names). A blocked name is not found, as on
a machine without it: `import x` raises ModuleNotFoundError, `importlib.util.find_spec(x)` returns None and
`importlib.metadata` finds no distribution of it.
"""
import os
import sys

_BLOCKED = frozenset(n.strip().lower().replace("-", "_") for n in os.environ.get("LENT_MACHINE_LACKS", "").split(",")
                     if n.strip())


def _blocked(name: str) -> bool:
    return name.partition(".")[0].lower().replace("-", "_") in _BLOCKED


class _Hiding:
    """Wraps one meta-path finder: blocked names are not found; everything else is the finder's own answer."""

    def __init__(self, inner) -> None:
        self._inner = inner

    def find_spec(self, name, path=None, target=None):
        find = getattr(self._inner, "find_spec", None)
        return None if _blocked(name) or find is None else find(name, path, target)

    def find_distributions(self, *args, **kwargs):
        find = getattr(self._inner, "find_distributions", None)
        dists = find(*args, **kwargs) if find is not None else ()
        return (d for d in dists if not _blocked(d.metadata["Name"] or ""))

    def invalidate_caches(self) -> None:
        fn = getattr(self._inner, "invalidate_caches", None)
        if fn is not None:
            fn()

    def __repr__(self) -> str:
        return f"_Hiding({self._inner!r})"


if _BLOCKED:
    sys.meta_path[:] = [f if isinstance(f, _Hiding) else _Hiding(f) for f in sys.meta_path]
