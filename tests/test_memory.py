"""The memory this process may use and refusing what would not fit it (memory.py): the machine's
MemAvailable lowered by RLIMIT_AS, a --max-memory limit in its place, a refusal naming the size to blame,
sizes written and read (20.1 GB, 512MiB), what a model holds counted on the meta device, and the
allocator kept from returning freed memory."""

from __future__ import annotations

import dataclasses
import os
import resource
import subprocess
import sys

import pytest
import torch
from torch import nn

import plainformer as pf
from plainformer import memory
from plainformer.families.memory_estimates import training_bytes
from plainformer.training.config import TrainConfig
from tests.reference.tiny_models import GPT_TINY


@dataclasses.dataclass
class Job:
    """A config whose bytes are rows · width · 1000 (hand-checkable), with a field of no default size."""

    rows: int = 1
    width: int = 4
    name: str = "job"
    cap: int | None = None


def _job_bytes(job: Job) -> int:
    return job.rows * job.width * 1000 + (job.cap or 0)


# ----------------------------------------------------------------------------- refusing

def test_an_estimate_that_fits_is_returned():
    with memory.memory_limit(10**6):
        assert memory.check_memory("it needs ~{needed}", _job_bytes, Job(rows=250)) == 10**6


def test_a_refusal_names_the_field_whose_default_lowers_the_estimate_most():
    with memory.memory_limit(10**6), pytest.raises(
            memory.MemoryBudgetError, match=r"^rows=1000: it needs ~10\.0 MB, more than the 1\.0 MB allowed$"):
        memory.check_memory("it needs ~{needed}", _job_bytes, Job(rows=1000, width=10))  # rows=1: 10 kB, width=4: 4 MB
    with memory.memory_limit(10**6), pytest.raises(memory.MemoryBudgetError, match=r"^width=10000: "):
        memory.check_memory("it needs ~{needed}", _job_bytes, Job(rows=100, width=10**4))  # width=4: 400 kB


def test_a_refusal_blames_no_field_when_none_is_above_its_default():
    assert issubclass(memory.MemoryBudgetError, ValueError)
    with memory.memory_limit(10**6), pytest.raises(
            memory.MemoryBudgetError, match=r"^it needs ~4\.0 MB, more than the 1\.0 MB allowed$"):
        memory.check_memory("it needs ~{needed}", lambda job: 4 * 10**6, Job())


def test_a_field_of_default_none_is_blamed_when_clearing_it_lowers_the_estimate():
    with memory.memory_limit(10**6), pytest.raises(memory.MemoryBudgetError, match=r"^cap=5000000: "):
        memory.check_memory("it needs ~{needed}", _job_bytes, Job(cap=5 * 10**6))


def test_a_training_refusal_names_the_batch_size_when_it_is_to_blame():
    config = pf.GPTConfig(**GPT_TINY)

    def estimate(model_config, train):
        return training_bytes(model_config, train.batch_size, eval_batch_size=train.eval_batch_size)

    with memory.memory_limit(10**9):
        assert memory.check_memory("training needs ~{needed}", estimate, config, TrainConfig()) < 10**9
        for field in ("batch_size", "eval_batch_size"):
            with pytest.raises(memory.MemoryBudgetError, match=rf"^{field}=100000000: training needs ~.* TB, "
                                                               r"more than the 1\.0 GB allowed$"):
                memory.check_memory("training needs ~{needed}", estimate, config, TrainConfig(**{field: 10**8}))


def test_what_the_process_holds_already_counts_towards_the_machines_memory(monkeypatch):
    monkeypatch.setattr(memory, "_machine_available", lambda: 10**6)
    assert memory.check_memory("it needs ~{needed}", _job_bytes, Job(rows=275), held=10**5) == 11 * 10**5
    with pytest.raises(memory.MemoryBudgetError, match=r"more than the 1\.1 MB available$"):
        memory.check_memory("it needs ~{needed}", _job_bytes, Job(rows=276), held=10**5)
    assert memory.available_phrase(held=10**5) == "the 1.1 MB available"
    with memory.memory_limit(10**6):
        assert memory.available_phrase(held=10**5) == "the 1.0 MB allowed"  # a limit is the whole budget


# ----------------------------------------------------------------------------- the memory available

def test_meminfo_reads_a_kilobyte_line_of_a_proc_file(tmp_path):
    status = tmp_path / "meminfo"
    status.write_text("MemTotal:       16318412 kB\nMemAvailable:    9876 kB\nOdd: x kB\n")
    assert memory._meminfo(str(status), "MemAvailable") == 9876 * 1024
    assert memory._meminfo(str(status), "Mem") is None  # a key is matched whole
    assert memory._meminfo(str(status), "Odd") is None
    assert memory._meminfo(str(tmp_path / "absent"), "MemAvailable") is None


def test_without_meminfo_the_free_pages_are_the_memory_available(monkeypatch):
    monkeypatch.setattr(memory, "_meminfo", lambda path, key: None)
    monkeypatch.setattr(memory, "_sysconf_bytes", lambda name: 12345 * 4096)
    monkeypatch.setattr(resource, "getrlimit", lambda kind: (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    assert memory.available_memory() == 12345 * 4096
    monkeypatch.setattr(memory, "_sysconf_bytes", lambda name: None)
    assert memory.available_memory() == 2**63  # nothing known: nothing refused


def test_the_machines_memory_is_its_ram_and_its_swap(tmp_path, monkeypatch):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       1000 kB\nMemAvailable:    500 kB\nSwapTotal:      24 kB\n")
    read = memory._meminfo
    monkeypatch.setattr(memory, "_meminfo", lambda path, key: read(str(meminfo), key))
    assert memory.machine_memory() == 1024 * 1024
    meminfo.write_text("MemTotal:       1000 kB\n")
    assert memory.machine_memory() == 1000 * 1024  # no swap line: no swap
    monkeypatch.setattr(memory, "_meminfo", lambda path, key: None)
    monkeypatch.setattr(memory, "_sysconf_bytes", lambda name: 7 * 4096 if name == "SC_PHYS_PAGES" else None)
    assert memory.machine_memory() == 7 * 4096
    monkeypatch.setattr(memory, "_sysconf_bytes", lambda name: None)
    assert memory.machine_memory() is None  # nothing known: no bound


def test_the_memory_available_honours_rlimit_as_and_memory_limit(monkeypatch):
    machine = memory.available_memory()
    assert machine > 0
    vm_size = memory._meminfo("/proc/self/status", "VmSize")
    monkeypatch.setattr(resource, "getrlimit", lambda kind: (vm_size + 10**6, resource.RLIM_INFINITY))
    assert memory.available_memory() <= 10**6 + 4096  # what the limit leaves, give or take a page grown since
    assert memory.available_memory(held=5) == memory.available_memory() + 5
    with memory.memory_limit(123):
        assert memory.available_memory(held=5) == 123  # a limit is the whole budget
        with memory.memory_limit(None):
            assert memory.available_memory() == 123
    assert memory.available_memory() <= 10**6 + 4096
    with pytest.raises(ValueError, match="limit must be a positive integer, got 0"), memory.memory_limit(0):
        pass


def test_a_cpu_device_has_the_memory_available_and_an_accelerator_its_free_memory(monkeypatch):
    with memory.memory_limit(12345):
        assert memory.device_available(torch.device("cpu")) == 12345
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (777, 10**9))  # (free, total), no GPU needed
    with memory.memory_limit(12345):
        assert memory.device_available(torch.device("cuda", 0)) == 777


# ----------------------------------------------------------------------------- sizes


@pytest.mark.parametrize("text, size", [
    ("64GB", 64 * 10**9), ("512MiB", 512 * 2**20), ("1.5 TB", 1_500_000_000_000), ("800k", 800_000),
    ("100", 100), ("2gib", 2 * 2**30), ("3 B", 3), (".5K", 500),
    pytest.param("9" * 400, int("9" * 400), id="400 nines"),
    pytest.param("4" + "0" * 398 + ".5k", 4 * 10**401 + 500, id="399 digits.5k")])
def test_a_size_is_parsed_in_decimal_or_binary_units_exactly(text, size):
    assert memory.parse_size(text) == size


def test_a_size_with_more_digits_than_python_converts_is_a_value_error():
    with pytest.raises(ValueError, match="digits"):
        memory.parse_size("9" * 5000)


@pytest.mark.parametrize("text", ["", "GB", "-1GB", "1e9", "1.5XB", "0", "0.4", "nan", "1 GB 2"])
def test_a_bad_size_is_refused(text):
    with pytest.raises(ValueError, match="size"):
        memory.parse_size(text)


@pytest.mark.parametrize("nbytes, text", [
    (812, "812 B"), (20_100_000_000, "20.1 GB"), (3_210_000_000_000, "3.2 TB"), (10**27, "1.0e+27 B"),
    (999_949, "999.9 kB"), (999_950, "1.0 MB"), (999_999_999, "1.0 GB"), (999_950 * 10**15, "1.0e+21 B"),
    pytest.param(int("9" * 400), "1.0e+400 B", id="400 nines")])
def test_a_size_is_written_for_a_reader(nbytes, text):
    assert memory.format_size(nbytes) == text


@pytest.mark.parametrize("text", ["0", "0.4", "12XB"])
def test_a_bad_size_message_quotes_what_was_given(text):
    with pytest.raises(ValueError, match=rf", got {text!r}$"):
        memory.parse_size(text)


# ----------------------------------------------------------------------------- what a model holds

class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(4, 8), nn.Linear(8, 4, bias=False)


class _Net(nn.Module):
    """An embedding (10 x 4), one block (4 x 8 + 8, 8 x 4), a head tied to the embedding, a 3 x 3 buffer."""

    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(10, 4)
        self.blocks = nn.ModuleList([_Block()])
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embedding.weight
        self.register_buffer("mask", torch.ones(3, 3))


def test_each_tensor_is_counted_once_and_the_blocks_linear_weights_are_the_hidden_matrices():
    net = _Net()
    assert [p.shape for p in memory.block_matrices(net)] == [(8, 4), (4, 8)]
    assert memory.count(net) == memory.Footprint(parameters=40 + 32 + 8 + 32, block_matrices=64, tensors=5,
                                                buffer_bytes=9 * 4)


def test_a_layer_named_in_times_counts_as_many_times_at_any_depth():
    wrapped = nn.Module()
    wrapped.inner = _Net()
    expected = memory.Footprint(parameters=40 + 3 * 72, block_matrices=3 * 64, tensors=1 + 3 * 3 + 1,
                                      buffer_bytes=36)
    assert memory.count(_Net(), {"blocks.0": 3}) == expected
    assert memory.count(wrapped, {"blocks.0": 3}) == expected


def test_a_vocabulary_the_data_decides_later_counts_as_none():
    """A tied GPT's parameters grow by d_model per token of the vocabulary, so that of vocab_size=0 is
    what a built model of vocab_size V holds less V · d_model."""
    built = pf.GPT(pf.GPTConfig(**GPT_TINY))
    unknown = memory.footprint(pf.GPT, memory.unchecked(pf.GPTConfig(**GPT_TINY), vocab_size=0))
    V, d = GPT_TINY["vocab_size"], GPT_TINY["d_model"]
    assert unknown.parameters == sum(p.numel() for p in built.parameters()) - V * d
    assert unknown.tensors == len(list(built.parameters())) + len(list(built.buffers()))


def test_a_vocabulary_the_data_decides_later_counts_as_none_with_a_bigram_table_of_its_square():
    """A bigram table holds V² · d_model parameters: with an untied head, the model of vocab_size=0 holds
    what one of vocab_size V holds less (2 V + V²) · d_model."""
    config = pf.GPTConfig(**GPT_TINY, bigram_embedding=True, tie_weights=False)
    built = pf.GPT(config)
    unknown = memory.footprint(pf.GPT, memory.unchecked(config, vocab_size=0))
    V, d = GPT_TINY["vocab_size"], GPT_TINY["d_model"]
    assert unknown.parameters == sum(p.numel() for p in built.parameters()) - (2 * V + V * V) * d


def test_an_unchecked_copy_changes_only_the_copy():
    config = pf.GPTConfig(**GPT_TINY)
    copy = memory.unchecked(config, n_layers=0)
    assert (copy.n_layers, config.n_layers) == (0, GPT_TINY["n_layers"])


# ----------------------------------------------------------------------------- the allocator

_CHURN = """
import resource, sys, torch
from plainformer.memory import keep_freed_memory
torch.set_num_threads(1)
kept = keep_freed_memory() if sys.argv[1] == "keep" else None
torch.ones(2**20)  # torch's own first allocations
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for step in range(1, 21):  # a step's activations of 4 MiB, a page larger each step, freed at its end
    torch.ones(2**20 + 1024 * step)
print(kept, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(not hasattr(__import__("ctypes").CDLL(None), "mallopt"), reason="no glibc malloc")
def test_kept_freed_memory_serves_the_next_steps_tensors_without_page_faults():
    """20 steps of a 4 MiB tensor (1,025-1,044 pages), each a page larger than the last: glibc's defaults
    map each afresh (a block larger than any freed before) and fault in every page (20,710 faults here);
    kept, the heap's pages are reused (20-1,061 faults: at most one tensor's growth)."""
    runs = {}
    for mode in ("default", "keep"):
        out = subprocess.run([sys.executable, "-c", _CHURN, mode], capture_output=True, text=True, check=True,
                             env={**os.environ, "OMP_NUM_THREADS": "1"}).stdout.split()
        runs[mode] = (out[0], int(out[1]))
    pages = sum(2**20 // 1024 + step for step in range(1, 21))  # 4-byte floats, 4 KiB pages
    assert runs["default"][1] >= 0.9 * pages
    assert runs["keep"][0] == "True" and runs["keep"][1] < 0.1 * pages


def test_without_mallopt_nothing_is_set(monkeypatch):
    monkeypatch.setattr(memory.ctypes, "CDLL", lambda name: object())
    assert memory.keep_freed_memory() is False
