"""FLOPs, tokens/s and MFU arithmetic, in this process."""

import pytest
import torch

from ddptrain.observe.throughput import FlopCount, device_peak_tflops, peak_tflops_of, throughput_record


def test_a_linear_language_models_counted_flops_are_six_times_parameters_times_tokens():
    """The textbook figure: forward 2N, backward 4N per token, N the non-embedding parameters
    (the head's input needs its gradient: the embedding is trained)."""
    vocab, width, batch, length = 256, 32, 4, 64
    model = torch.nn.Sequential(torch.nn.Embedding(vocab, width), torch.nn.Linear(width, vocab, bias=False))
    tokens = torch.randint(0, vocab, (batch, length))
    count = FlopCount()
    with count.first_step():
        logits = model(tokens)
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten()).backward()
    expected = 6 * width * vocab * batch * length
    assert count.per_step == pytest.approx(expected, rel=0.01)
    with count.first_step():  # counted once: later steps run as they are
        model(tokens).sum().backward()
    assert count.per_step == pytest.approx(expected, rel=0.01)


def test_attention_on_the_cpu_counts_what_torch_counts_for_cuda_s_kernels():
    """scaled_dot_product_attention's CPU kernel had no FLOP formula (a GPT's FLOPs fell 7.7% short
    of nanoGPT's formula on CPU): forward and backward now count by the formulas torch gives its
    CUDA kernels, so a step counts the same on either device."""
    from torch.nn import functional as F
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

    shape = (2, 4, 64, 16)  # batch, heads, tokens, head size
    q, k, v = (torch.randn(shape, requires_grad=True) for _ in range(3))
    count = FlopCount()
    with count.first_step():
        F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
    assert count.per_step == sdpa_flop_count(shape, shape, shape) + sdpa_backward_flop_count(shape, shape, shape, shape)
    assert count.per_step > 0


def test_tokens_per_second_and_mfu_follow_from_the_counts():
    record = throughput_record(samples=640, seconds=2.0, steps=10, job_flops_per_step=4e12,
                               tokens_per_sample=128, peak_tflops=10.0, world_size=2)
    assert record == {"tokens_per_s": 640 / 2.0 * 128, "tflops": 20.0, "mfu": 1.0}
    assert "mfu" not in throughput_record(640, 2.0, 10, 4e12, None, None, 2)  # no known peak: no MFU
    assert throughput_record(640, 2.0, 10, None, None, 10.0, 2) == {}


def test_cpus_have_no_peak_unless_given():
    assert device_peak_tflops(torch.device("cpu")) is None


def test_a_small_models_tflops_keep_three_significant_digits():
    record = throughput_record(64, 1.0, 8, 1.2345e7, None, 0.5, 2)  # 8 steps of 12.3 MFLOP in 1 s
    assert record["tflops"] == 9.88e-5 and record["mfu"] == 9.88e-5


def test_the_summary_keeps_a_small_models_tflops_to_3_significant_digits(tmp_path):
    import json

    from ddptrain.observe.summary import summarize

    epochs = [{"kind": "epoch", "epoch": e, "step": 32 * (e + 1), "train_loss": 1.0, "epoch_time_s": 0.3,
               "samples_per_s": 7850.04, "tflops": 5.2134e-07, "mfu": 1.23456e-05} for e in range(2)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in epochs))
    summary = summarize(tmp_path)
    assert (summary["tflops"], summary["mfu"], summary["samples_per_s"]) == (5.21e-07, 1.23e-05, 7850.0)


def test_a_gpu_s_peak_is_known_from_its_name_the_longer_model_first():
    """torch.cuda.get_device_name's strings: a PCIe H100 is not an SXM one, an L40S not an L40."""
    assert peak_tflops_of("NVIDIA H100 80GB HBM3") == 989.0 and peak_tflops_of("NVIDIA H100 PCIe") == 756.0
    assert peak_tflops_of("NVIDIA L40S") == 362.0 and peak_tflops_of("NVIDIA L40") == 181.0
    assert peak_tflops_of("NVIDIA A100-SXM4-80GB") == 312.0 and peak_tflops_of("NVIDIA GeForce GTX 1080") is None


def test_a_small_mfu_is_shown_with_its_digits_never_as_zero():
    from ddptrain.observe.report import console_line

    line = console_line({"kind": "epoch", "epoch": 0, "step": 8, "train_loss": 1.0, "tflops": 9.88e-5, "mfu": 4.2e-5})
    assert line.endswith("9.88e-05 TFLOP/s (MFU 0.0042%)"), line
    large = console_line({"kind": "epoch", "epoch": 0, "step": 8, "tflops": 400.0, "mfu": 0.4046})
    assert large.endswith("(MFU 40.5%)"), large
