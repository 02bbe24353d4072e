"""Reward functions for examples/custom_reward: plain Python, no jaxrl import needed.

jaxrl calls each as reward(prompt, completion, **fields), where the fields are the other columns
of the problem's row (here `word`), and sums them with task.reward_weights. A reward that raises
or hangs costs its group only (rl.reward_timeout_s, rl.max_reward_failures).
"""


def correct(prompt: str, completion: str, word: str, **fields) -> float:
    """1 for the word spelled backwards, letter for letter."""
    return float(completion.strip() == word[::-1])


def short(prompt: str, completion: str, word: str, **fields) -> float:
    """A small bonus for answering in one word, as a format reward would."""
    return 0.1 if len(completion.split()) == 1 else 0.0
