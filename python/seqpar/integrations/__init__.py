# SPDX-License-Identifier: Apache-2.0
"""seqpar in other libraries: transformers (seqpar.integrations.transformers)."""
