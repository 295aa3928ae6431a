"""Two deploys of one agent, ``orders``, loaded through RATCHET_AGENT_MODULES: ``before`` and
``after``, which changes the agent's system prompt and removes one of its tools."""
