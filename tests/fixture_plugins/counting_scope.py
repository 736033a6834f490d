"""A plugin wrapping the runner's device-token scope factory to count forwards."""
from contextlib import contextmanager

from vtcore import hookimpl

CALLS = {"hook": 0, "enter": 0, "exit": 0, "families": []}


def reset() -> None:
    CALLS.update(hook=0, enter=0, exit=0, families=[])


@hookimpl
def vtcore_device_token_scope(family, scope):
    CALLS["hook"] += 1
    CALLS["families"].append(family.name)

    @contextmanager
    def counting(device_ids, host_ids_stale):
        CALLS["enter"] += 1
        with scope(device_ids, host_ids_stale) as override:
            yield override
        CALLS["exit"] += 1

    return counting
