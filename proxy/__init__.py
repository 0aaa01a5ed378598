"""sluice's proxy (`sluice-proxy`): the request path and what feeds it. Python 3.10+.

Owns, layered so imports go one way (bottom first):

    wire/                    the contract with the control plane (imports nothing else)
    compat, errors, http, interfaces, waiters, stats, config     leaves
    replica, policies, prefix, readyset                         the ready set and routing
    upstream, pool, exchange, continuation, resume, server      the request path
    sources/, redisurl, stopping                                where ready sets come from
    admin, metrics, app, runner, cli, skyserve                  the process around it

Never imports `controlplane` (`python scripts/import_graph.py` checks it), so it runs
where only the proxy is installed, e.g. inside Sky Serve's controller on Python 3.10.
"""
