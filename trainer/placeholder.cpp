// placeholder until trainer/config.cpp lands
