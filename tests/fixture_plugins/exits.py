"""A plugin that calls sys.exit() at import."""
import sys

sys.exit("this plugin exits at import")
