"""The controller: reconciles every service in Redis towards its spec.

Owns: the reconcile loop (`loop.Controller`), one service's plan (`serviceplan`) and
the steps that make it (`planner`), the launch and termination tasks (`tasks`),
the per-service autoscalers (`scalestate`), the controller's config (`config`),
and the leader lease around it (`leader.run_controller`). What it may import:
`MAY_IMPORT` in scripts/import_graph.py (tests/test_layout.py runs it); nothing in
controlplane imports it but the CLI and `sluice run` (controlplane/run).

`Controller.step()` reconciles each service once; `Controller.run()` calls it
whenever something happens (a nudge on the control channel, a probe result, a
launch or termination finishing, a drain or probe falling due) and at least
every `reconcile_interval`. `run_controller()` adds the leader lease: it
stands by until it holds the lease, leads while it keeps it, and stands by
again if it loses it. Time comes from one injectable clock.

One step of one service is planned on a consistent read (`Store.read_state`) and
written in ONE `Store.commit_with` (nothing written when nothing changed); its seven
numbered steps are written down in `controlplane.reconcile.planner`, beside the
`# 1.`-`# 7.` sections that make them. The commit is all-or-nothing and
optimistic: if an ops command wrote the service record or a replica the plan touches
since the read, nothing is written and the service is planned again from a fresh
read. Side effects (launches, terminations, events, the autoscaler's decision)
happen only after the commit.
"""

from controlplane.reconcile.config import ControllerConfig, ReadinessProber, default_backends
from controlplane.reconcile.leader import run_controller
from controlplane.reconcile.loop import Controller
from controlplane.reconcile.scalestate import AutoscalerRegistry

__all__ = [
    "AutoscalerRegistry",
    "Controller",
    "ControllerConfig",
    "ReadinessProber",
    "default_backends",
    "run_controller",
]
