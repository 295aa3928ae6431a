"""What a worker host holds while the capacity benchmark's tasks run, sampled on a thread:
the provider's calls in flight, the host's Postgres connections and its memory."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

import httpx

from benchmarks.harness.common import libpq_url
from benchmarks.harness.processes import pg_sockets, process_tree, rss_mb

if TYPE_CHECKING:
    import psycopg

# Each sample walks /proc: sampled more often, the bench would load the host it measures.
SAMPLE_SECONDS = 0.5
# Only this database's: other stacks (a test run, say) may share the server.
WORKER_CONNECTIONS = (
    "SELECT count(*) FROM pg_stat_activity"
    " WHERE application_name LIKE 'ratchet-worker%' AND datname = current_database()"
)


def pg_port() -> int:
    """The configured database's port, by which the worker's sockets to it are found."""
    from sqlalchemy.engine import make_url

    return make_url(libpq_url()).port or 5432


class Sampler:
    """Every 0.5 s while tasks run: the calls the provider has in flight, the worker host's
    Postgres connections (by application name and by socket) and its resident memory."""

    def __init__(self, *, stub_url: str, worker_pid: int, pg_port: int) -> None:
        self.stub_url = stub_url
        self.worker_pid = worker_pid
        self.pg_port = pg_port
        self.series: dict[str, list[float]] = {
            "in_flight": [],
            "pg_by_name": [],
            "pg_by_socket": [],
            "rss_mb": [],
            "processes": [],
        }
        self.missed = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sampler", daemon=True)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        import psycopg

        with (
            psycopg.connect(libpq_url(), autocommit=True, application_name="ratchet-bench") as db,
            httpx.Client(timeout=5) as http,
        ):
            while not self._stop.wait(SAMPLE_SECONDS):
                try:
                    self._sample(db, http)
                except (httpx.HTTPError, OSError, psycopg.Error):
                    self.missed += 1  # reported; one lost sample must not end the series

    def _sample(self, db: psycopg.Connection[Any], http: httpx.Client) -> None:
        pids = process_tree(self.worker_pid)
        by_name = db.execute(WORKER_CONNECTIONS).fetchone()
        self.series["in_flight"].append(http.get(f"{self.stub_url}/stats").json()["in_flight"])
        self.series["pg_by_name"].append(by_name[0] if by_name else 0)
        self.series["pg_by_socket"].append(pg_sockets(pids, port=self.pg_port))
        self.series["rss_mb"].append(rss_mb(pids))
        self.series["processes"].append(len(pids))
