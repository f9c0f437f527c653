"""The host-routed step plan moved to prefetch/offload/step_plan.py (the
controller's `plan` part), with Note [Host-routed step pins]. The name
stays for the code that imports it from here."""
from prefetch.offload.step_plan import HostStepPlan

__all__ = ["HostStepPlan"]
