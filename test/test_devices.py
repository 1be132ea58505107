"""The serving device (`runtime.devices`): a device this process cannot serve on is refused
at configure, naming it and what is visible; a GPU is described as nvidia-smi names it."""
import types

import pytest
import torch

from molmobot_policy.runtime import devices


@pytest.fixture
def cuda_build(monkeypatch):
    """A CUDA build of torch seeing `count` GPUs (whatever this machine has)."""
    def see(count: int) -> None:
        monkeypatch.setattr(torch.version, 'cuda', '13.0')
        monkeypatch.setattr(torch.cuda, 'device_count', lambda: count)
    return see


def test_cpu_serves_and_is_described_as_cpu():
    assert devices.check_device('cpu') == torch.device('cpu')
    assert devices.describe_device('cpu') == 'cpu'


def test_a_string_that_is_no_torch_device_is_refused_by_name():
    with pytest.raises(ValueError, match=r"device 'gpu1' is not a torch device; expected 'cpu'"):
        devices.check_device('gpu1')


def test_cuda_on_a_torch_built_without_cuda_is_refused(monkeypatch):
    monkeypatch.setattr(torch.version, 'cuda', None)
    with pytest.raises(ValueError, match=r"device 'cuda:0': this torch .* is built without CUDA"):
        devices.check_device('cuda:0')


def test_cuda_without_a_visible_gpu_is_refused_naming_cuda_visible_devices(cuda_build,
                                                                         monkeypatch):
    cuda_build(0)
    monkeypatch.setenv('CUDA_VISIBLE_DEVICES', '')
    with pytest.raises(ValueError, match=r"device 'cuda': no CUDA device is visible to this "
                                         r"process \(CUDA_VISIBLE_DEVICES=''"):
        devices.check_device('cuda')


def test_an_index_beyond_the_visible_gpus_is_refused_with_the_count(cuda_build, monkeypatch):
    cuda_build(2)
    monkeypatch.setenv('CUDA_VISIBLE_DEVICES', '4,5')
    monkeypatch.delenv('CUDA_DEVICE_ORDER', raising=False)
    with pytest.raises(ValueError) as error:
        devices.check_device('cuda:2')
    assert str(error.value) == (
        "device 'cuda:2': 2 CUDA devices visible, cuda:0 to cuda:1 (CUDA_VISIBLE_DEVICES="
        "'4,5', CUDA_DEVICE_ORDER unset; cuda:N counts the visible GPUs)")
    assert devices.check_device('cuda:1') == torch.device('cuda:1')


def test_a_gpu_is_described_by_name_memory_and_pci_bus(cuda_build, monkeypatch):
    cuda_build(2)
    monkeypatch.setenv('CUDA_VISIBLE_DEVICES', '2,3')
    monkeypatch.setenv('CUDA_DEVICE_ORDER', 'PCI_BUS_ID')
    properties = types.SimpleNamespace(name='NVIDIA H200', total_memory=140 * 2**30,
                                       pci_domain_id=0, pci_bus_id=0x1B, pci_device_id=0)
    seen = []
    monkeypatch.setattr(torch.cuda, 'get_device_properties',
                        lambda device: seen.append(device) or properties)
    assert devices.describe_device('cuda:1') == (
        "cuda:1 = NVIDIA H200, 140 GiB, PCI bus 00000000:1B:00.0 (CUDA_VISIBLE_DEVICES='2,3', "
        "CUDA_DEVICE_ORDER='PCI_BUS_ID')")
    assert seen == [torch.device('cuda:1')]


@pytest.mark.skipif(not torch.cuda.is_available(), reason='needs a CUDA GPU')
def test_this_machines_gpu_is_described_as_torch_names_it():
    name = torch.cuda.get_device_name(0)
    described = devices.describe_device('cuda:0')
    assert described.startswith(f'cuda:0 = {name}, '), described
    assert ', PCI bus ' in described, described
    with pytest.raises(ValueError, match='CUDA devices? visible'):
        devices.check_device(f'cuda:{torch.cuda.device_count()}')
