"""EAGLE-3 draft training: extract target hidden states, train a draft with training-time test,
export it for vLLM and SGLang."""
