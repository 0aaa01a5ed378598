"""Where `sluice controller` and `sluice run` import the controller from; the
controller itself is `controlplane.reconcile`."""

from controlplane.reconcile import (
    Controller,
    ControllerConfig,
    default_backends,
    default_holder,
    run_controller,
    unique_holder,
)

__all__ = [
    "Controller",
    "ControllerConfig",
    "default_backends",
    "default_holder",
    "run_controller",
    "unique_holder",
]
