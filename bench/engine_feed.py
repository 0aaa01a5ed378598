"""The controller's engine telemetry without a controller, for benches: registers one
service whose READY replicas are the given URLs (one commit), then runs the
`EngineScraper` on them until killed, publishing their view for proxies run with
``--redis URL --service NAME --engine-load``.

    python bench/engine_feed.py --redis URL --prefix P --service S --interval 0.5 URL...

Prints "ready" once the service is committed and the first view published.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from controlplane.engines.scraper import EngineScraper, ScrapeTarget
from controlplane.records import ReplicaRecord, ServiceRecord
from controlplane.states import ReplicaStatus
from controlplane.store import Store


async def main(args: argparse.Namespace) -> None:
    async with Store.from_url(args.redis, prefix=args.prefix) as store:
        await store.register_service(
            ServiceRecord(name=args.service, created_at=time.time(), policy=args.policy),
            b"{}")  # fmt: skip
        await store.commit(args.service, replica_updates=[
            ReplicaRecord(id=i + 1, status=ReplicaStatus.READY, version=1, url=url)
            for i, url in enumerate(args.urls)])  # fmt: skip
        scraper = EngineScraper(store, timeout=min(2.0, args.interval))
        await scraper.start()
        try:
            scraper.track(args.service, [ScrapeTarget(i + 1, url, interval=args.interval)
                                         for i, url in enumerate(args.urls)])  # fmt: skip
            await scraper.step()
            print("ready", flush=True)
            await scraper.run()
        finally:
            await scraper.aclose()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--redis", required=True)
    ap.add_argument("--prefix", default="sluice")
    ap.add_argument("--service", default="bench")
    ap.add_argument("--policy", default="least_load")
    ap.add_argument("--interval", type=float, default=1.0)
    ap.add_argument("urls", nargs="+")
    asyncio.run(main(ap.parse_args()))
