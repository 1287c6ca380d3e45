"""Structured output: constraints (JSON schema, regex, choice, grammar) checked against limits before any native
compile (`limits`), test-compiled where a native crash cannot take the server down (`isolation`), compiled to
grammar matchers (`compiler`) owned by a manager keyed by request id (`manager`); a step's allowed-token masks as
arrays the runner consumes (`masks`)."""
