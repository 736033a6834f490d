"""The ``vtcore`` command line."""
