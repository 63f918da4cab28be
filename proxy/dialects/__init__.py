"""Other model APIs spoken by agents, run as chat completions so one recorder serves them all.

An agent that speaks the OpenAI Responses API (``responses/``) or the Anthropic Messages API
(``messages/``) is answered in its own API, but its call is translated to a chat completions
request and executed by the same ``ModelCall`` (``proxy/relay.py``) as a chat call: the same exact token ids and
log-probs, sampling notes, splicing and record. The record keeps the chat request the engine saw
(what the trainer reads) and the client's own request and API beside it. ``base.py`` is what a
dialect gives the relay; ``shared.py`` what the two dialects do alike (ids, reasoning, events).
"""
