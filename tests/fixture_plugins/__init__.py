"""Tiny vtcore plugin modules that the plugin tests load through hand-made entry points.

Each module is one plugin (entry-point value ``fixture_plugins.<module>`` with ``tests/`` on
``sys.path``). They import nothing heavy at import time, like a real plugin must.
"""
