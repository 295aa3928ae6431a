"""A peer to compare with: the same agent loop in LangGraph, checkpointed by ``PostgresSaver``.

A graph of two nodes, the model (scripted like Ratchet's: a calculator call per step but the
last, which answers) and the tool, on the same PostgreSQL, each task a thread of its own,
run by a pool of ``--threads`` threads; every superstep's checkpoint is written before the
next one starts (``durability="sync"``: what a crash may lose is what Ratchet's checkpoint
after every step keeps). Its tables live in a schema of their own (``bench_langgraph``).

Run as ``python -m benchmarks.servers.langgraph_peer``; prints one JSON line: tasks/s,
and the CPU of this process and of the machine per step over the timed span.

With ``--stub URL`` it is the capacity benchmark's HTTP-tool peer instead: the same agent
as LangGraph users write it in asyncio, checkpointed by ``AsyncPostgresSaver`` (a pool of
``--threads`` connections): the model node asks the OpenAI-compatible stub at URL, the tool
node makes the ``http_request`` the model asked for, both on one shared ``httpx.AsyncClient``,
and every task is started at once in one process (:func:`run_http`).
"""

from __future__ import annotations

import argparse
import json
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

SCHEMA = "bench_langgraph"
WARM_UP = 20


def build(steps: int, url: str, threads: int) -> tuple[Any, Any]:
    """The compiled graph and its connection pool."""
    import psycopg
    from langchain_core.messages import AIMessage, ToolMessage
    from langgraph.checkpoint.postgres import PostgresSaver
    from langgraph.graph import END, START, MessagesState, StateGraph
    from psycopg_pool import ConnectionPool

    def model(state: Any) -> dict[str, Any]:
        done = sum(isinstance(m, ToolMessage) for m in state["messages"])
        if done < steps - 1:
            call = {"name": "calculator", "args": {"expression": "6*7"}, "id": f"call-{done}"}
            return {"messages": [AIMessage(content="", tool_calls=[call])]}
        return {"messages": [AIMessage(content="done")]}

    def tool(state: Any) -> dict[str, Any]:
        calls = getattr(state["messages"][-1], "tool_calls", [])
        return {"messages": [ToolMessage(content="42", tool_call_id=c["id"]) for c in calls]}

    def route(state: Any) -> str:
        return "tool" if getattr(state["messages"][-1], "tool_calls", None) else END

    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA IF NOT EXISTS {SCHEMA}")
    pool = ConnectionPool(
        url,
        min_size=threads,
        max_size=threads,
        kwargs={
            "autocommit": True,
            "prepare_threshold": 0,
            "options": f"-c search_path={SCHEMA}",
        },
        open=True,
    )
    saver = PostgresSaver(pool)  # type: ignore[arg-type]
    saver.setup()
    graph = StateGraph(MessagesState)
    graph.add_node("model", model)
    graph.add_node("tool", tool)
    graph.add_edge(START, "model")
    graph.add_conditional_edges("model", route, ["tool", END])
    graph.add_edge("tool", "model")
    return graph.compile(checkpointer=saver), pool


def run_all(graph: Any, count: int, threads: int) -> None:
    from langchain_core.messages import HumanMessage

    def one(_: int) -> None:
        config = {"configurable": {"thread_id": str(uuid.uuid4())}}
        out = graph.invoke({"messages": [HumanMessage("benchmark")]}, config, durability="sync")
        if out["messages"][-1].content != "done":
            raise RuntimeError("the task did not end with its answer")

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, range(count)))


def build_http(client: Any, stub: str, saver: Any) -> Any:
    """The HTTP-tool graph: a model node that asks the stub, a tool node that sends the
    requests the model asked for, both on ``client``."""
    import json as jsonlib

    from langchain_core.messages import AIMessage, ToolMessage, convert_to_openai_messages
    from langgraph.graph import END, START, MessagesState, StateGraph

    async def model(state: Any) -> dict[str, Any]:
        body = {"model": "bench", "messages": convert_to_openai_messages(state["messages"])}
        reply = (await client.post(f"{stub}/v1/chat/completions", json=body)).json()
        message = reply["choices"][0]["message"]
        calls = [
            {
                "name": c["function"]["name"],
                "args": jsonlib.loads(c["function"]["arguments"]),
                "id": c["id"],
            }
            for c in message.get("tool_calls") or []
        ]
        return {"messages": [AIMessage(content=message.get("content") or "", tool_calls=calls)]}

    async def tool(state: Any) -> dict[str, Any]:
        results = []
        for call in state["messages"][-1].tool_calls:
            response = await client.request("GET", call["args"]["url"])
            result = {"status": response.status_code, "body": response.text}
            results.append(ToolMessage(content=jsonlib.dumps(result), tool_call_id=call["id"]))
        return {"messages": results}

    def route(state: Any) -> str:
        return "tool" if getattr(state["messages"][-1], "tool_calls", None) else END

    graph = StateGraph(MessagesState)
    graph.add_node("model", model)
    graph.add_node("tool", tool)
    graph.add_edge(START, "model")
    graph.add_conditional_edges("model", route, ["tool", END])
    graph.add_edge("tool", "model")
    return graph.compile(checkpointer=saver)


async def run_http(url: str, stub: str, *, tasks: int, connections: int) -> dict[str, Any]:
    """A warm-up of a few tasks, then ``tasks`` tasks started at once; the span's figures."""
    import asyncio

    import httpx
    import psycopg
    from langchain_core.messages import HumanMessage
    from langgraph.checkpoint.postgres.aio import AsyncPostgresSaver
    from psycopg_pool import AsyncConnectionPool

    from benchmarks.harness.processes import machine_busy_seconds

    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA IF NOT EXISTS {SCHEMA}")
    pool = AsyncConnectionPool(
        url,
        min_size=connections,
        max_size=connections,
        kwargs={
            "autocommit": True,
            "prepare_threshold": 0,
            "options": f"-c search_path={SCHEMA}",
        },
        open=False,
    )
    await pool.open()
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    try:
        async with httpx.AsyncClient(timeout=60, limits=limits) as client:
            saver = AsyncPostgresSaver(pool)  # type: ignore[arg-type]
            await saver.setup()
            graph = build_http(client, stub, saver)

            async def one() -> float:
                config = {"configurable": {"thread_id": str(uuid.uuid4())}}
                out = await graph.ainvoke(
                    {"messages": [HumanMessage("benchmark")]}, config, durability="sync"
                )
                if out["messages"][-1].content != "done":
                    raise RuntimeError("the task did not end with its answer")
                return time.time()

            await asyncio.gather(*(one() for _ in range(min(WARM_UP, tasks))))
            cpu, machine, started = time.process_time(), machine_busy_seconds(), time.time()
            finished = await asyncio.gather(*(one() for _ in range(tasks)))
            cpu, machine = time.process_time() - cpu, machine_busy_seconds() - machine
    finally:
        await pool.close()
    return {
        "started": started,
        "seconds": max(finished) - started,
        "cpu_seconds": cpu,
        "machine_busy_seconds": machine,
    }


def main() -> None:
    from benchmarks.harness.processes import machine_busy_seconds

    parser = argparse.ArgumentParser()
    parser.add_argument("--url", required=True)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--tasks", type=int, required=True)
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--stub", help="the HTTP-tool run against this stub model's URL")
    args = parser.parse_args()
    if args.stub:
        import asyncio

        figures = asyncio.run(
            run_http(args.url, args.stub, tasks=args.tasks, connections=args.threads)
        )
        print(json.dumps(figures))
        return
    graph, pool = build(args.steps, args.url, args.threads)
    try:
        run_all(graph, WARM_UP, args.threads)
        cpu, machine, started = time.process_time(), machine_busy_seconds(), time.time()
        run_all(graph, args.tasks, args.threads)
        seconds = time.time() - started
        cpu, machine = time.process_time() - cpu, machine_busy_seconds() - machine
    finally:
        pool.close()
    steps = args.tasks * args.steps
    print(
        json.dumps(
            {
                "tasks_per_s": args.tasks / seconds,
                "seconds": seconds,
                "process_cpu_ms_per_step": 1000 * cpu / steps,
                "machine_cpu_ms_per_step": 1000 * machine / steps,
            }
        )
    )


def measure(steps: int, *, count: int, threads: int, url: str) -> dict[str, Any]:
    """One run of ``count`` tasks in a process of its own; its figures."""
    import subprocess
    import sys

    argv = [sys.executable, "-m", __name__, "--url", url, "--steps", str(steps)]
    argv += ["--tasks", str(count), "--threads", str(threads)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the LangGraph peer failed: {done.stderr.strip()[-2000:]}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def measure_http(stub: str, *, count: int, connections: int, url: str) -> dict[str, Any]:
    """One HTTP-tool run of ``count`` tasks in an asyncio process of its own; its figures."""
    import subprocess
    import sys

    argv = [sys.executable, "-m", __name__, "--url", url, "--stub", stub]
    argv += ["--tasks", str(count), "--threads", str(connections)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=900, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the LangGraph peer failed: {done.stderr.strip()[-2000:]}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def drop(url: str) -> None:
    """Remove the peer's tables."""
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f"DROP SCHEMA IF EXISTS {SCHEMA} CASCADE")


if __name__ == "__main__":
    main()
