"""Multi-LoRA serving's host side: adapters in host memory (`adapter`), read from PEFT folders without torch
(`peft`), which adapter sits in which device slot (`slots`, least recently used first), and the manager the
engine owns (`manager`), which loads the slots a step needs through the runner."""
