# frozen_string_literal: true

require_relative '../../../puppet_x/vmhost/guest'

# Writes a file in a VM's guest through vmhostd (vm.file_push) when the catalog is compiled:
# atomically, checked by sha256 in the guest, at most 768 KiB. The host's [agent] allow_exec
# must be true. Returns {path, size, sha256}.
Puppet::Functions.create_function(:'vmhost::guest_file_push') do
  # @param name the VM
  # @param path absolute path in the guest
  # @param content the file's content
  # @param opts mode (octal string such as '0644', or an integer), owner ('user[:group]'),
  #   mkdir (create missing directories), socket
  # @return [Hash] vm.file_push's answer
  dispatch :guest_file_push do
    param 'String[1]', :name
    param 'Pattern[/\A\//]', :path
    param 'Variant[String, Binary]', :content
    optional_param 'Struct[{
      Optional[mode] => Variant[Pattern[/\A(0o)?[0-7]{1,4}\z/], Integer[0, 4095]],
      Optional[owner] => String[1],
      Optional[mkdir] => Boolean,
      Optional[socket] => String[1],
    }]', :opts
  end

  def guest_file_push(name, path, content, opts = {})
    data = content.is_a?(Puppet::Pops::Types::PBinaryType::Binary) ? content.binary_buffer : content
    PuppetX::Vmhost::Guest.push(name, path, data, opts)
  rescue PuppetX::Vmhost::Error => e
    raise Puppet::Error, "vmhost::guest_file_push: #{e.message}"
  end
end
