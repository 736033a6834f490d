"""Stands in for a module that takes seconds to import (torch), which a plugin's registration must not import."""
