"""The GLM-5 (glm_moe_dsa) forward pass, written once over a small backend interface."""
