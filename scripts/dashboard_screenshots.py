"""Screenshots of every dashboard page, against a running Ratchet seeded with a small mixed
run (succeeded, failed, cancelled and running tasks). Uses the system's Chromium.

    ratchet dev --port 8011 &                       # or any stack
    python scripts/dashboard_screenshots.py http://127.0.0.1:8011 KEY docs/dashboard
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import httpx
from playwright.sync_api import sync_playwright

CALC = [
    {"tool_calls": [{"name": "calculator", "arguments": {"expression": "6*7"}}]},
    {"content": "The answer is 42."},
]


def seed(url: str, key: str) -> str:
    """A small mixed run; returns the id of a task that is still running."""
    auth = {"Authorization": f"Bearer {key}"}
    with httpx.Client(base_url=url, headers=auth, timeout=30) as client:
        for i in range(12):
            client.post(
                "/v1/tasks",
                json={
                    "input": f"What is 6 times 7? ({i})",
                    "model": "scripted",
                    "tools": ["calculator"],
                    "model_options": {"script": CALC},
                    "metadata": {"customer": str(40 + i % 3), "tour": "yes"},
                },
            ).raise_for_status()
        for i in range(3):  # a task allowed one step that needs two fails at its second
            client.post(
                "/v1/tasks",
                json={
                    "input": f"Break ({i})",
                    "model": "scripted",
                    "tools": ["calculator"],
                    "max_steps": 1,
                    "model_options": {"script": CALC},
                    "metadata": {"customer": "43"},
                },
            ).raise_for_status()
        for amount in (120, 4800):  # calls that wait for a person's decision
            client.post(
                "/v1/tasks",
                json={
                    "input": f"Refund {amount} to customer 42",
                    "model": "scripted",
                    "tools": ["calculator"],
                    "approval": {"tools": ["calculator"], "timeout_seconds": 86400},
                    "model_options": {
                        "script": [
                            {
                                "tool_calls": [
                                    {
                                        "name": "calculator",
                                        "arguments": {"expression": f"{amount}*1"},
                                    }
                                ]
                            },
                            {"content": "refunded"},
                        ]
                    },
                    "metadata": {"customer": "42"},
                },
            ).raise_for_status()
        slow = client.post(
            "/v1/tasks",
            json={
                "input": "Think slowly",
                "model": "scripted",
                "tools": ["calculator"],
                "model_options": {"script": [{"delay_ms": 60000, "content": "done"}]},
                "metadata": {"customer": "44"},
            },
        ).json()["id"]
        doomed = client.post(
            "/v1/tasks",
            json={
                "input": "Cancel me",
                "model": "scripted",
                "model_options": {"script": [{"delay_ms": 60000, "content": "x"}]},
            },
        ).json()["id"]
        time.sleep(3)
        client.post(f"/v1/tasks/{doomed}/cancel")
        time.sleep(2)
    return slow


def shoot(url: str, key: str, out: Path) -> None:
    running = seed(url, key)
    out.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path="/usr/bin/chromium")
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        page.goto(f"{url}/dashboard/login")
        page.screenshot(path=str(out / "login.png"))
        page.fill("#key", key)
        page.click("button[type=submit]")
        page.wait_for_url(f"{url}/dashboard")
        for name, path in [
            ("overview", "/dashboard?window=1h"),
            ("tasks", "/dashboard/tasks"),
            ("approvals", "/dashboard/approvals"),
            ("task", f"/dashboard/tasks/{running}"),
            ("workers", "/dashboard/workers"),
            ("ratelimits", "/dashboard/ratelimits"),
            ("webhooks", "/dashboard/webhooks"),
            ("tenants", "/dashboard/tenants"),
        ]:
            page.goto(url + path)
            page.screenshot(path=str(out / f"{name}.png"), full_page=True)
        browser.close()


if __name__ == "__main__":
    shoot(sys.argv[1].rstrip("/"), sys.argv[2], Path(sys.argv[3]))
