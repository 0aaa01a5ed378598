"""Replica backends: the ways of running replicas, behind one interface (`base.py`).

    base              ReplicaBackend, Launched, the BackendError tree
    local             replicas as local process groups (LocalBackend)
      fixedport       the rule for a run command that names its own port
      localproc       a local replica's process group from its handle; last-resort stop
    external          replicas registered by ops scripts; never launched here
    skypilot          one SkyPilot cluster per replica (SkyPilotBackend)
      skypilot_task   cluster names, the SkyPilot task, status texts (pure)
      skypilot_status the cache of `sky.status` and its refresher
      skypilot_sdk    SkyPilot's SDK behind one adapter (imported lazily)

What it may import (never the store: backends do not touch Redis; nor the
controller): scripts/import_graph.py `MAY_IMPORT` (run by tests/test_layout.py).
"""
