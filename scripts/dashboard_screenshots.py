"""Screenshots of every dashboard page, against a running Ratchet seeded with a small mixed
run (succeeded, failed, cancelled and running tasks). Uses the system's Chromium.

    ratchet dev --port 8011 &                       # or any stack
    python scripts/dashboard_screenshots.py http://127.0.0.1:8011 KEY docs/dashboard

A fourth argument, names separated by commas (``thread,task-live``), takes only those.
``family`` (a task with sub-agent tasks and a question for the person) needs the test agents:
run the server with ``RATCHET_AGENT_MODULES=tests.sample_agents``.
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


ANSWER = (
    "Your order 1042 left our warehouse on Tuesday and is with the carrier now. At 42 km "
    "a day it reaches you in about three days, so expect it on Friday. I have set a reminder "
    "to check its tracking on Thursday morning and will write to you if anything changes. "
    "Is there anything else I can help you with today?"
)


def seed_thread(client: httpx.Client) -> str:
    """A thread of three finished turns (tool calls among them) and a fork of it."""
    thread = client.post(
        "/v1/threads", json={"agent": "default", "metadata": {"customer": "42"}}
    ).json()["id"]
    turns = [
        (
            "Where is my order 1042? It shipped Tuesday.",
            [
                {"tool_calls": [{"name": "calculator", "arguments": {"expression": "126/42"}}]},
                {"content": "It is 126 km away; at 42 km a day it arrives in 3 days."},
            ],
        ),
        ("So Friday?", [{"content": "Yes: Friday, if the carrier keeps its pace."}]),
        (
            "And if I pay for express, <b>twice</b> as fast?",
            [
                {"tool_calls": [{"name": "calculator", "arguments": {"expression": "3/2"}}]},
                {"content": "Then 1.5 days: Wednesday evening or Thursday morning."},
            ],
        ),
    ]
    for message, script in turns:
        client.post(
            f"/v1/threads/{thread}/runs",
            json={
                "input": message,
                "model": "scripted",
                "tools": ["calculator"],
                "model_options": {"script": script},
            },
        ).raise_for_status()
    _settle(client, thread)
    client.post(f"/v1/threads/{thread}/fork", json={"turn": 2}).raise_for_status()
    return str(thread)


def _settle(client: httpx.Client, thread: str) -> None:
    for _ in range(300):
        if client.get(f"/v1/threads/{thread}").json()["status"] == "idle":
            return
        time.sleep(0.1)


def streaming(client: httpx.Client) -> str:
    """A task whose model writes its answer slowly (a minute, spread over its words)."""
    return str(
        client.post(
            "/v1/tasks",
            json={
                "input": "When does my order arrive?",
                "model": "scripted",
                "model_options": {"script": [{"delay_ms": 60000, "content": ANSWER}]},
                "metadata": {"customer": "42"},
            },
        ).json()["id"]
    )


def family(client: httpx.Client) -> str:
    """A lead that handed three questions to sub-agents (which answered) and asked the person
    a question in the same step: parked on it, with its children's tree and usage."""
    delegate = [
        {"name": "researcher", "arguments": {"task": "Which regions had incidents in May?"}},
        {"name": "researcher", "arguments": {"task": "What does each region cost per hour?"}},
        {"name": "napper", "arguments": {"task": "Wait for the build to settle."}},
        {"name": "ask_user", "arguments": {"question": "Deploy release 4.2 to eu-west-1 now?"}},
    ]
    task = client.post(
        "/v1/tasks",
        json={
            "agent": "lead",
            "input": "Pick a region for release 4.2 and deploy it.",
            "model": "scripted",
            "model_options": {"script": [{"tool_calls": delegate}, {"content": "Deployed."}]},
            "metadata": {"release": "4.2"},
        },
    ).json()["id"]
    for _ in range(300):
        children = client.get(f"/v1/tasks/{task}/children").json()["items"]
        if len(children) == 3 and {c["status"] for c in children} == {"succeeded"}:
            break
        time.sleep(0.1)
    return str(task)


def shoot_live(url: str, key: str, out: Path, names: set[str]) -> None:
    """The thread page, a task page while its answer is being written, and a task's family."""
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}) as client:
        thread = seed_thread(client)
        task = streaming(client) if "task-live" in names else None
        parent = family(client) if "family" in names else None
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path="/usr/bin/chromium")
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        page.goto(f"{url}/dashboard/login")
        page.fill("#key", key)
        page.click("button[type=submit]")
        page.wait_for_url(f"{url}/dashboard")
        if "thread" in names:
            page.goto(f"{url}/dashboard/threads/{thread}")
            page.screenshot(path=str(out / "thread.png"), full_page=True)
        if task is not None:
            page.goto(f"{url}/dashboard/tasks/{task}")
            page.locator("[data-partial] pre").filter(has_text="three days").wait_for()
            page.locator("#conv-h").scroll_into_view_if_needed()
            page.screenshot(path=str(out / "task-live.png"), full_page=True)
        if parent is not None:
            page.goto(f"{url}/dashboard/tasks/{parent}")
            page.locator("blockquote.question").wait_for()
            waits = page.locator("#waits-h").locator("xpath=..").bounding_box()
            assert waits is not None
            height = waits["y"] + waits["height"] + 16
            clip = {"x": 0, "y": 0, "width": 1400, "height": height}
            page.screenshot(path=str(out / "family.png"), full_page=True, clip=clip)
        browser.close()


def shoot(url: str, key: str, out: Path, only: set[str] | None = None) -> None:
    out.mkdir(parents=True, exist_ok=True)
    if only is not None:
        shoot_live(url, key, out, only)
        return
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
    shoot_live(url, key, out, {"thread", "task-live"})


if __name__ == "__main__":
    only = set(sys.argv[4].split(",")) if len(sys.argv) > 4 else None
    shoot(sys.argv[1].rstrip("/"), sys.argv[2], Path(sys.argv[3]), only)
