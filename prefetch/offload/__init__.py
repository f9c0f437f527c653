"""The parts of an offloaded model's controller (prefetch/offload/controller.py),
each in a file of its own and owned by the controller: the routing context
predictors read, the speculation gate, deferred speculation, preload,
accounting, sync-free decode and the host-routed step plan."""
