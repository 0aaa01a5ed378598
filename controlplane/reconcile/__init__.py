"""The controller: reconciles every service in Redis towards its spec.

Owns: the reconcile loop (`loop.Controller`), one service's plan (`plan`) and
the steps that make it (`planner`), the launch and termination tasks (`tasks`),
the per-service autoscalers (`autoscaling`), the controller's config (`config`),
and the leader lease around it (`leader.run_controller`). May import:
controlplane's records, states, store, spec, rollout, autoscaler, lifecycle,
prober, lease and backends, and `proxy.wire`; nothing in controlplane imports it
but the CLI and `sluice run` (controlplane/run).

`Controller.step()` reconciles each service once; `Controller.run()` calls it
whenever something happens (a nudge on the control channel, a probe result, a
launch or termination finishing, a drain or probe falling due) and at least
every `reconcile_interval`. `run_controller()` adds the leader lease: it
stands by until it holds the lease, leads while it keeps it, and stands by
again if it loses it. Time comes from one injectable clock.

One step of one service, planned on a consistent read (`Store.read_state`)
and written in ONE `Store.commit_with` (nothing written when nothing changed):

1. finished launches: PROVISIONING -> STARTING with the backend's URL and handle
   (or FAILED when its setup failed, FAILED_PROVISION for any other launch
   failure); finished terminations: the record is deleted (or FAILED_CLEANUP);
   launches a dead controller began are adopted or forgotten;
2. liveness: a replica whose process is gone -> FAILED; a spot replica its
   backend reports preempted -> PREEMPTED;
3. probe results (`controlplane.prober`, `controlplane.lifecycle`): READY /
   NOT_READY / FAILED_*;
4. relabel: live replicas of an older version whose spec differs from the
   latest only in relabel-safe fields (`spec.is_count_only_change`), and
   every external replica, become the latest version. In the same commit the
   active versions are recomputed, so the ready set never passes through a
   state where nobody serves;
5. scale and roll out: the service's autoscaler (`reconcile.autoscaling`) is
   brought up to date (a decision when one is due, a reset after an update, a
   scale from zero on a proxy's "demand" nudge); launch latest-version replicas
   up to its target (split into spot and on-demand ones by
   `autoscaler.fallback_plan` when the spec uses spot); retire old-version
   replicas as new ones become READY
   (rolling: one old per new READY one; blue_green: all at once when the new
   version has min_replicas READY); retire surplus ones in scale-down order
   (earliest state, older version, larger id first; instance-aware: lowest
   capacity before larger id). Launching stops for a version that never
   had a READY replica once one of its replicas failed for good before it
   was ever ready (`rollout.gives_up_version`, Sky Serve's rule);
6. drain and clean up: a retired replica is SHUTTING_DOWN (out of the ready
   set) until no live proxy reports a request in flight on it, at most
   `drain_seconds` or the spec's `service.sluice.max_drain_seconds` (no drain if
   it never was READY; the rule is `controlplane.reconcile.drain`'s), then
   terminated at once and its record deleted; failed and PREEMPTED replicas are terminated at once
   (and replaced by step 5, since they no longer count). A service
   marked SHUTTING_DOWN by `ops.down` is unregistered when no replica is left;
7. the service status (READY, REPLICA_INIT, NO_REPLICA, FAILED).

Planning does no Redis I/O and never awaits: the specs and the autoscaling
signals are read before it
(`loop.Controller._gather`), and the steps above are `planner.Planner`'s. The
commit is all-or-nothing and optimistic: if an ops command wrote the service
record or a replica the plan touches since the read, nothing is written and the
service is planned again from a fresh read. Side effects (launches,
terminations, events, the autoscaler's decision) happen only after the commit.
"""

from controlplane.reconcile.autoscaling import AutoscalerRegistry
from controlplane.reconcile.config import ControllerConfig, ReadinessProber, default_backends
from controlplane.reconcile.leader import run_controller
from controlplane.reconcile.loop import Controller

__all__ = [
    "AutoscalerRegistry",
    "Controller",
    "ControllerConfig",
    "ReadinessProber",
    "default_backends",
    "run_controller",
]
