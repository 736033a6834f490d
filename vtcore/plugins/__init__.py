"""Plugin machinery: hook specs, the guarded entry-point loader and the family registry."""
from vtcore.plugins.hookspecs import hookimpl

__all__ = ["hookimpl"]
