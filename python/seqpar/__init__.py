# SPDX-License-Identifier: Apache-2.0
"""seqpar: exact distributed attention over packed long-context batches, from PyTorch."""
