module workload-manager/tools/image/pause

go 1.22
