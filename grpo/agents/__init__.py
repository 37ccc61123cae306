"""Tools and environments for agents: a model's tool calls parsed from its own chat-template format and run
with a time limit, environments loaded and checked, and the record of one episode.

What it deliberately is not: the episode loop. Nothing here generates tokens, touches an engine or the
trainer, or decides which tokens train; those belong to the loop that uses these pieces.
"""
