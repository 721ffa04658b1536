"""The end-to-end run's rule reward (verl's custom_reward_function): the share of the
response's words that are even-numbered (``w0``, ``w2``, ...). Random weights score about
half; the policy can move it within a few GRPO steps, so the reward curve shows training."""


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    words = [w for w in solution_str.split() if w.startswith("w") and w[1:].isdigit()]
    if not words:
        return 0.0
    return sum(int(w[1:]) % 2 == 0 for w in words) / len(words)
