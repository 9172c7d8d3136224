module gosame

go 1.19
