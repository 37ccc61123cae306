"""Tools and environments for agents: a model's tool calls parsed from its own chat-template format and run
with a time limit, environments loaded and checked, and episodes of several turns played on any engine
(`episodes.run_episodes`) as one `Rollout` whose mask covers only the model's tokens.

What it deliberately is not: the trainer. It decides which tokens are the model's; rewards, advantages and
the loss read its `Rollout` as they read single completions.
"""
