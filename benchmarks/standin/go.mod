module apsd/standin

go 1.19
