"""Sync-free decode moved to prefetch/offload/sync_free.py (the
controller's `sync` part) and its path choice to
prefetch/offload/path_choice.py; the Notes once here (Note [Steady pins],
Note [Step pins], Note [Routings nobody reads], Note [Routing read-back
queued early], Note [Which path a step takes]) are there. These names stay
for the code that imports them from here."""
from prefetch.offload.path_choice import _FIRST_HOLD, _MAX_HOLD, _TRY_STEPS, PathChoice
from prefetch.offload.sync_free import SyncFreeDecode

__all__ = ["SyncFreeDecode", "PathChoice", "_FIRST_HOLD", "_MAX_HOLD", "_TRY_STEPS"]
