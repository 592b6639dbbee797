"""The argument checks both device paths of the smddp backend share (in process, no ranks)."""
import pytest

torch = pytest.importorskip("torch")

from smdistributed.dataparallel.torch import collective_args as args  # noqa: E402


def test_split_sizes_default_to_an_even_split_and_are_checked():
    assert args.split_sizes(None, 6, 3, "all_to_all_single", "input") == [2, 2, 2]
    assert args.split_sizes([0, 5, 1], 6, 3, "all_to_all_single", "output") == [0, 5, 1]
    with pytest.raises(ValueError, match="does not split evenly over 4 ranks"):
        args.split_sizes([], 6, 4, "all_to_all_single", "input")
    with pytest.raises(ValueError, match="2 input split sizes for 3 ranks"):
        args.split_sizes([3, 3], 6, 3, "all_to_all_single", "input")
    with pytest.raises(ValueError, match="negative output split size"):
        args.split_sizes([-1, 4, 3], 6, 3, "all_to_all_single", "output")
    with pytest.raises(ValueError, match=r"input split sizes \[4, 4, 4\] add up to 12 rows, but the input has 6"):
        args.split_sizes([4, 4, 4], 6, 3, "all_to_all_single", "input")


def test_rows_of_tensors_without_rows():
    assert args.rows(torch.tensor(1.0)) == 1 and args.row_numel(torch.tensor(1.0)) == 1
    assert args.rows(torch.empty(0, 4)) == 0 and args.row_numel(torch.empty(0, 4)) == 4


def test_counts_sizes_and_dtypes():
    t = [torch.empty(3)] * 2
    args.one_per_rank(t, 2, "all_gather", "output")
    with pytest.raises(ValueError, match="all_gather: 2 output tensors for 3 ranks"):
        args.one_per_rank(t, 3, "all_gather", "output")
    with pytest.raises(ValueError, match="gather: output tensor 1 has 4 elements, expected 3"):
        args.each_numel([torch.empty(3), torch.empty(4)], 3, "gather", "output")
    with pytest.raises(TypeError, match="different dtypes"):
        args.same_dtype([torch.empty(1), torch.empty(1, dtype=torch.float64)], "all_to_all")
    args.times_size(torch.empty(6), torch.empty(3), 2, "all_gather_into_tensor", "output")
    with pytest.raises(ValueError, match="output has 5 elements, expected 3 x 2 ranks"):
        args.times_size(torch.empty(5), torch.empty(3), 2, "all_gather_into_tensor", "output")
