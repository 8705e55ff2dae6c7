import numpy as np
import pytest

from coli.model.sampling import Sampler, SamplingParams


def test_greedy_takes_first_maximum():
    assert Sampler(SamplingParams())(np.array([0.1, 3.0, 3.0, 1.0], np.float32)) == 1


def test_seeded_sampling_is_reproducible_and_respects_top_k():
    logits = np.linspace(0, 1, 50).astype(np.float32)
    a = [Sampler(SamplingParams(greedy=False, temperature=0.7, top_k=5, seed=3))(logits) for _ in range(3)]
    s = Sampler(SamplingParams(greedy=False, temperature=0.7, top_k=5, seed=3))
    draws = [s(logits) for _ in range(200)]
    assert a[0] == draws[0]
    assert set(draws) <= set(range(45, 50))


def test_top_p_keeps_the_smallest_prefix():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05])).astype(np.float32)
    s = Sampler(SamplingParams(greedy=False, top_p=0.75, seed=0))
    assert set(s(logits) for _ in range(300)) == {0, 1}


@pytest.mark.parametrize("kw", [dict(temperature=0), dict(top_p=0), dict(top_p=1.5), dict(top_k=-1)])
def test_bad_parameters_are_refused(kw):
    with pytest.raises(ValueError):
        SamplingParams(greedy=False, **kw).validate()
