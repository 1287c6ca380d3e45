"""Structured output: constraints (JSON schema, regex, choice, grammar) compiled to grammar matchers, owned by a
manager keyed by request id; a step's allowed-token masks as arrays the runner consumes."""
