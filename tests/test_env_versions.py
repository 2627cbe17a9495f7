"""Versions from Ascend install-info files (both layouts) and the torch_npu ↔ torch ↔ CANN ↔ Python matrix."""

from pathlib import Path

import pytest

from tasks.envcheck import compat, versions

ENV = Path(__file__).parent / "fixtures" / "env"


def test_legacy_toolkit_layout():
    cann = versions.find_cann(ENV / "ascend-legacy")
    assert cann["version"] == "8.3.RC1" and cann["layout"] == "ascend-toolkit" and cann["arch"] == "aarch64"
    assert ["V100R001C15", "V100R001C15"] in cann["compatible_version"]


def test_new_cann_layout_and_versioned_dir():
    cann = versions.find_cann(ENV / "ascend-cann")
    assert (cann["version"], cann["layout"], cann["arch"]) == ("9.1.0", "cann", "x86_64")
    assert versions.find_cann(ENV / "ascend-versioned")["version"] == "8.5.0"  # /usr/local/Ascend/cann-8.5.0


def test_ascend_home_path_wins_over_root():
    home = ENV / "ascend-cann" / "cann"
    found = versions.find_cann(ENV / "ascend-legacy", home=str(home))
    assert found["version"] == "9.1.0" and found["layout"] == "cann"


def test_nothing_installed(tmp_path):
    assert versions.find_cann(tmp_path) is None
    facts = versions.collect(tmp_path, install_info=tmp_path / "none.info")
    assert facts["cann"] is None and facts["driver"] is None and facts["firmware"] is None
    assert facts["torch"].startswith("2.13.0") and facts["torch_npu"] is None


def test_driver_firmware_and_install_info_redirect(tmp_path):
    assert versions.find_driver(ENV / "ascend-legacy") == {
        "version": "24.1.rc1",
        "innerversion": "V100R001C15SPC006B220",
        "compatible_firmware": [["7.0.0", "7.2.99"]],
    }
    assert versions.find_firmware(ENV / "ascend-legacy")["version"] == "7.1.0.11.220"
    # The driver installer records its own path: the driver is found there even when the toolkit root differs.
    info = tmp_path / "ascend_install.info"
    info.write_text(
        f"UserName=HwHiAiUser\nUserGroup=HwHiAiUser\nFirmware_Install_Type=full\n"
        f"Driver_Install_Type=full\nDriver_Install_Path_Param={ENV / 'ascend-cann'}\n"
    )
    facts = versions.collect(ENV / "ascend-versioned", install_info=info)
    assert facts["cann"]["version"] == "8.5.0" and facts["firmware"]["version"] == "7.3.0.1.231"


def test_import_failure_without_cann_is_recognised():
    found = versions.diagnose_import_failure((ENV / "import-torch-no-cann.txt").read_text())
    assert "CANN is not loaded" in found["cause"] and "libhccl.so" in found["cause"]
    assert "set_env.sh" in found["fix"] and "TORCH_DEVICE_BACKEND_AUTOLOAD=0" in found["fix"]


def test_import_failure_other_torch_npu_cause():
    found = versions.diagnose_import_failure((ENV / "import-torch-npu-mismatch.txt").read_text())
    assert "no attribute '_autoload'" in found["cause"] and "CANN is not loaded" not in found["cause"]
    assert versions.diagnose_import_failure("ModuleNotFoundError: No module named 'torch'") is None


M = compat.load_matrix()


@pytest.mark.parametrize(
    "torch_npu,torch,cann",
    [
        ("2.12.0", "2.12.0", "9.1.0"),
        ("2.10.0.post4", "2.10.0+cpu", "9.1.0"),
        ("2.8.0", "2.8.0", "8.3.RC1"),
        ("2.1.0.post10", "2.1.0", "8.0.0"),
    ],
)
def test_matrix_hits(torch_npu, torch, cann):
    c = compat.check_npu_stack(M, torch, torch_npu, cann)
    assert c["status"] == "ok", c


def test_matrix_torch_mismatch_names_the_pair():
    c = compat.check_npu_stack(M, "2.10.0", "2.9.0.post2", "9.0.0")
    assert c["status"] == "fail"
    # CANN 9.0.0 has no torch 2.10 build: the newest published pair for it is named.
    assert "requires torch 2.9.0" in c["detail"] and "pip install torch==2.9.0 torch-npu==2.9.0.post2" in c["detail"]


def test_matrix_cann_mismatch_names_the_pair_for_installed_cann():
    c = compat.check_npu_stack(M, "2.9.0", "2.9.0.post2", "8.5.0")
    assert c["status"] == "fail" and "requires CANN 9.0.0" in c["detail"]
    assert "pip install torch==2.9.0 torch-npu==2.9.0 (CANN 8.5.0)" in c["detail"]  # same torch, right build


def test_matrix_same_cann_line_and_eol_warn():
    assert compat.check_npu_stack(M, "2.8.0", "2.8.0", "8.3.RC2")["status"] == "warn"
    c = compat.check_npu_stack(M, "2.4.0", "2.4.0", "8.0.RC3")
    assert c["status"] == "warn" and "end-of-life" in c["detail"]


def test_matrix_torch_npu_without_cann_and_unknown_builds():
    c = compat.check_npu_stack(M, "2.12.0", "2.12.0", None)
    assert c["status"] == "fail" and "needs CANN 9.1.0" in c["detail"]
    assert compat.check_npu_stack(M, "2.13.0", "2.13.0", "9.1.0")["status"] == "warn"  # newer than the table
    c = compat.check_npu_stack(M, "2.12.0", "2.13.0", "9.1.0")
    assert c["status"] == "fail" and "pip install torch==2.13.0" in c["detail"]


def test_cann_without_torch_npu_suggests_install():
    c = compat.check_npu_stack(M, "2.13.0+cpu", None, "8.3.RC1")
    assert c["status"] == "warn" and "pip install torch==2.8.0 torch-npu==2.8.0 (CANN 8.3.RC1)" in c["detail"]
    assert compat.check_npu_stack(M, "2.13.0", None, None)["status"] == "ok"


def test_python_table():
    assert compat.check_python(M, "3.11.7", "2.13.0+cpu")["status"] == "ok"
    c = compat.check_python(M, "3.9.18", "2.10.0")
    assert c["status"] == "fail" and "Python 3.9 is not supported by torch 2.10.0" in c["detail"]
    assert compat.check_python(M, "3.11.7", "1.13.1")["status"] == "warn"


def test_driver_firmware_and_driver_cann():
    legacy = versions.collect(ENV / "ascend-legacy", install_info="/nonexistent")
    names = {c["name"]: c["status"] for c in compat.version_checks(legacy)}
    assert names["driver-firmware"] == "ok" and names["driver-cann"] == "ok"
    new = versions.collect(ENV / "ascend-cann", install_info="/nonexistent")
    checks = {c["name"]: c for c in compat.version_checks(new)}
    assert checks["driver-firmware"]["status"] == "fail"
    assert "firmware 7.3.0.1.231 is outside the range [7.0.0, 7.2.99]" in checks["driver-firmware"]["detail"]
    assert checks["driver-cann"]["status"] == "warn" and "V100R001C15" in checks["driver-cann"]["detail"]
