"""Language models for sessions: the host's broker behind `llm_query`, and the RLM loop.

`broker.py` makes the calls (an OpenAI-compatible endpoint, through the `openai` client)
within each session's budgets; `bridge.py` answers a kernel's `llm` requests with it;
`context.py` puts a large context in a session; `rlm.py` runs Recursive Language Models.
The key and the endpoint's address stay here: the sandbox sees neither.
"""
