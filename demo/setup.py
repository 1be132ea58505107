"""Installs molmobot_policy_demo (the simulated robot and the demo) with colcon (ament_python)
on a ROS 2 install, or with pip. It needs molmobot_policy installed beside it."""
from glob import glob

from setuptools import find_packages, setup

package_name = 'molmobot_policy_demo'

setup(
    name=package_name,
    version='0.1.0',
    packages=find_packages(include=[package_name, package_name + '.*']),
    data_files=[
        ('share/ament_index/resource_index/packages', ['resource/' + package_name]),
        ('share/' + package_name, ['package.xml']),
        ('share/' + package_name + '/launch', glob('launch/*.launch.py')),
        ('share/' + package_name + '/config', glob('config/*.yaml')),
    ],
    install_requires=['setuptools'],
    zip_safe=True,
    maintainer='molmobot_policy maintainers',
    maintainer_email='maintainers@molmobot-policy.invalid',
    description='Simulated Kinova Jaco robot (MuJoCo) and demo runner for molmobot_policy',
    license='Apache-2.0',
    entry_points={
        'console_scripts': [
            'sim_robot = molmobot_policy_demo.sim.robot_node:main',
            'demo = molmobot_policy_demo.demo:main',
        ],
    },
)
